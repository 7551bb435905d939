"""The inference worker (`inferq worker`): one engine of one model, fed by its model's lanes."""
