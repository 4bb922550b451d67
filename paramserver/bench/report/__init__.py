"""The pages written from measured runs' JSON: ``results`` (docs/RESULTS.md, ``make
results``), ``readme`` (README's generated figures block) and ``figures`` (the plots of
docs/bench).

May import: nothing else of ``bench``; below it, what ``bench`` may.
"""
