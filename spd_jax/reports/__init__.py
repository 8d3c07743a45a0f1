"""Reports: every table, plot, card and lineage built from the results JSONL that `infer.evaluate` writes
(and the replay results of `infer.replay`), in one place that both `infer` and `train` call.

    results.py  the rows read, sorted by drafter (by content) and pooled; the method/drafter tables
    tables.py   markdown tables of pooled rows and the cost model's projections beside them
    plots.py    S0 and speed against n, the cycle by part, learning curves, S0 against training positions
    lineage.py  a PSM directory's lineage.json: S0 of each PSM it has held
    cards.py    the drafter card (one template for PSM and EAGLE-3) and its merge with a hand-written card
    replay.py   infer.replay's table and plot

Plain data in (row dicts, run.json / psm.json / lineage.json contents), text and PNGs out; imports
neither `infer` nor `train`, and runs no model.
"""
