"""Tensor-, expert- and pipeline-parallel ranks: their layout (:mod:`.config`), collectives and stage links
(:mod:`.process_group` across processes, :mod:`.thread_group` for the in-process split-emulating reference of
:mod:`.emulated`), the rank process (:mod:`.rank_process`) and the offline driver (:mod:`.llm`).
"""
