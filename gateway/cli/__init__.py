"""The `visiongate` command line: `serve`, `demo`, `convert`, `worker` and the ops subcommands."""
