"""The `remat` command line (`main`): the target a command plans (`target`), the
largest value that fits (`fit`) and the progress display (`progress`)."""
