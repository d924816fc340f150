"""What a run returns (GenerationResult, SampleStats) and how results are kept: the results folder,
provenance, plots."""
