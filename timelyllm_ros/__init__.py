"""timelyllm_ros: time-sensitive LLM serving for robot fleets (TimelyLLM, paper 000)."""
