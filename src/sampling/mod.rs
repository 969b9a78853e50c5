//! Token sampling: per-request parameters, logits processors, seeded RNG, stop strings.
