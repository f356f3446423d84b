"""One build in private staging, the inputs it read, and the check that the library loads."""
