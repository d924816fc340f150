"""Models: loading one from a recipe entry, and the pool that loads each once per process."""
