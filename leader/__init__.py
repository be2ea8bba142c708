"""Leader election and fencing for blob masters (imported as ``blobha.leader``)."""

from blobha.leader.election import Deposed, LeaderElection, answer_within, is_failure
from blobha.leader.history import LeaderHistory, Term

__all__ = ["Deposed", "LeaderElection", "LeaderHistory", "Term", "answer_within", "is_failure"]
