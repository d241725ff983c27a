"""What a user declares: `Pipeline`, `GrainPipeline`, `Order`, `Pack`, `Mix`, transforms, and the loader state format."""
