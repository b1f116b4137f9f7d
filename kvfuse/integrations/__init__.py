"""Integrations of kvfuse with model libraries.

Each submodule imports its library when it is imported itself (``import kvfuse`` never does):

- :mod:`kvfuse.integrations.transformers`: Hugging Face transformers models (``generate``,
  plain forwards and ``torch.compile``) on kvfuse paged caches; needs ``pip install kvfuse[hf]``.
"""
