"""The consumer's control: its membership in the group, its slots, and the controller that
turns etcd's and the broker's events into state-machine steps."""
