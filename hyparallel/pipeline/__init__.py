"""Pipeline stage splitting and schedules (the Pipeline issue)."""
