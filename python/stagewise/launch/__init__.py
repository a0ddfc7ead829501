"""Starting the stage processes of a run plan: on this machine, on other hosts (printed commands
or ssh), or under torchrun."""
