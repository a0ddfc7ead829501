"""The lines a stage process prints on its standard output for whoever started it (a launcher
reads them, also through ssh): ``STAGEWISE-LISTENING host port`` once it listens, and
``STAGEWISE-FAILED {json}`` with its own words when it fails. A module of its own, importing
nothing, so that a stage failing while it still imports torch can say so."""

READY_LINE = "STAGEWISE-LISTENING"
FAILED_LINE = "STAGEWISE-FAILED"


def print_listening(host: str, port: int) -> None:
    """Tell whoever started this process where it listens (its ``READY_LINE``)."""
    print(f"{READY_LINE} {host} {port}", flush=True)
