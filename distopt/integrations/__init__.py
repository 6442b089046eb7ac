"""Adapters for training frameworks, one submodule each, imported only by name so that importing
distopt never imports a framework: ``distopt.integrations.transformers`` (Hugging Face ``Trainer``)
and ``distopt.integrations.lightning`` (Lightning)."""
