"""``paramserver bench NAME``: measurements that print ratios taken side by side in one run."""
