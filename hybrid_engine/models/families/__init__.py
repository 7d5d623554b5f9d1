"""One module per model family, each registering its `ModelSpec` (`models.spec`)."""
