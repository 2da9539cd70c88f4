"""The checkpoint wing: whole checkpoint directories committed by a file written last.

One commit sequence (``_sequence``) that every way of committing runs: ``staged_dir`` alone
(``_staged_dir``) or as a collective (``_collective``), the DCP writers (``safestage.dcp``),
``commit_in_place`` (``_in_place``) and ``safestage recover`` (``_recover``); the commit file
(``_manifest``); the readers (``_verify``: ``verify``, ``latest_complete``); a run's timeline
after a rollback (``_timeline``); retention (``_prune``). Its public names are re-exported by
``safestage``; it stands on the file wing (one save pipeline, ``_save``/``_stage``/``_publish``),
never the other way round.
"""
