"""Who the tenants are: the tracker, identities, pods, remembered workloads, policies."""
