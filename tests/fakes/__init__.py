"""Fakes of etcd and of the consumer's broker port, for unit tests of pure logic."""
