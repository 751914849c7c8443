"""`flux2klein batch`: many requests from one manifest, grouped by shape, resumable, sharded.

`manifest` reads the file into numbered entries (fields, output template, hash); `grouping`
packs the valid ones into device batches and takes a shard's part; `results` keeps the record
of finished items (resume, `--merge`); `run` is the loop.
"""
