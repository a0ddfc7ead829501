# Interim bridge on this branch only; replaced when the transport restructuring is merged.
from stagewise.transport.shm_channel import LINK_TRANSPORTS, upgrade_accepted, upgrade_dialled

__all__ = ["LINK_TRANSPORTS", "upgrade_accepted", "upgrade_dialled"]
