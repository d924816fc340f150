"""The plugin contracts (verifiers, drafters), the law helpers the built-ins are made of, plugin
parameters, and the registry that finds plugins through stevedore (the built-ins are in specdec_plugins)."""
