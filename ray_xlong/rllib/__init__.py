"""Ray and RLlib adapters: the only layer (with rollout) that imports ray."""
