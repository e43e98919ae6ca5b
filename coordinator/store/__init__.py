"""The etcd group store: every key of a stream's group, its codec, mirror, sessions and election."""
