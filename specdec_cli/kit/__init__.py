"""The plugin author's kit: tiny models, exact laws, statistical checks and the conformance checks
(public as specdec_cli.testing)."""
