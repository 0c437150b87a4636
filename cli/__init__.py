"""The `hybridspec` console script: one parser, one module per subcommand group."""
