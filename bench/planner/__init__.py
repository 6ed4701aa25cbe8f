"""The planner's simulator and its traces (issue 23)."""
