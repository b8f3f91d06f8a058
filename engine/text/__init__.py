"""Text in and out of token ids: the `Tokenizer` interface with `HFTokenizer` (the `tokenizers` library) and
`ByteTokenizer` (the embedded default model's), the `IncrementalDetokenizer` that streams text deltas that
never need taking back, and chat templates rendered as transformers renders them (`chat_template.py`).
Never imports transformers.
"""
