"""Trajectory records into training `Sample`s: the token path from the engine's own ids when records carry
`turns`, the message path (through `masks/`) otherwise (`build`), slime's `Sample` or its stand-in
(`sample`), and SkyRL-style dense batches (`collate`). Imports `masks/` and the root's `settings`.
"""
