"""The ops worker (`inferq ops`): webhook deliveries, the reaper, batches, and beat."""
