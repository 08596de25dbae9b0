"""The command line: the Lightning subcommands and their pre-flight checks, the launchers, what a run prints."""
