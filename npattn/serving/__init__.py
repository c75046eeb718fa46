"""The serving calls: decoding against a kv-cache and packed variable-length batches.

:mod:`~npattn.serving.kvcache` (``attention_with_kvcache``, ``plan_with_kvcache``;
contiguous, row-indexed and paged caches) and :mod:`~npattn.serving.varlen`
(``attention_varlen``). They check their arguments, then run on the plans of
:mod:`npattn.api`; the paged pools users manage are in :mod:`npattn.nn.cache`.
"""
