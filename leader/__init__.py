"""Leader election and fencing for blob masters (imported as ``blobha.leader``)."""

from blobha.leader.election import Deposed, LeaderElection

__all__ = ["Deposed", "LeaderElection"]
