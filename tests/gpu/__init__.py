"""Tests that need a real GPU; each skips with a reason where none exists."""
