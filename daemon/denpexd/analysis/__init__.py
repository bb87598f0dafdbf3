"""The analyses `Engine.diagnose()` composes: pure functions of aggregates, tracks, rules and
clock estimates, one module per question (see ARCHITECTURE.md)."""
