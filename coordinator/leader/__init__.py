"""The leader: the assignment policy, the assignor, resizes, and the service that runs them."""
