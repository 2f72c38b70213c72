"""The transformers integration: ``patch`` (an attention function registered with HF's
AttentionInterface), ``RaggedCache`` (a transformers Cache), the keyword a model takes its
cache under, and the model loader."""
