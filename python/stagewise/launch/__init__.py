"""Starting the stage processes of a run plan: on this machine, on other hosts (printed commands
or ssh), on a Ray cluster, or under torchrun."""


class LaunchError(RuntimeError):
    """A launcher could not start the run's processes for a reason of its own, not the model's: a
    cluster it cannot reach or join, resources the cluster does not have. The message names what
    is wrong and what to change; a command prints it as it is, not as a model that failed to load."""
