"""The documented path of the dense-batch collator, `slime_adapter.collate.collate`; the code lives in
`slime_adapter.samples.collate`.
"""

from slime_adapter.samples.collate import CollatableSample, collate, extract_response

__all__ = ["CollatableSample", "collate", "extract_response"]
