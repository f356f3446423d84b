"""What a key is made of: the spec, the flags, the toolchain fingerprint and probes, the hash, the
tracked inputs."""
