"""The commit protocol, one place to review: the one committer and its repair of ``latest``, the committer
lease (:mod:`.ownership`, its records), retention and its trash, and the checks a staged step passes."""
