"""The commands beside training: doctor, comm, consolidate, export and the memory estimate."""
