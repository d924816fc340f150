"""What every layer shares: errors, recipes, inputs and caches, randomness, sampling, timing, theory.
Imports nothing of the project above it."""
