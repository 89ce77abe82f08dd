"""Tensor- and expert-parallel ranks: their layout (:mod:`.config`), collectives (:mod:`.process_group` across
processes, :mod:`.thread_group` for the in-process split-emulating reference) and the offline driver (:mod:`.llm`).
"""
