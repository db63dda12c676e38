"""The message path's tokens and loss mask: a conversation rendered with the tokenizer's own chat template,
tokenized once, and each assistant message's generated text located and turned into mask-1 tokens
(`loss_mask.MultiTurnLossMaskGenerator`; one span locator per template type in `span_locators`).
Imports nothing else of the adapter.
"""
