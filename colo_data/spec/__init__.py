"""What a user declares: `Pipeline`, `Order`, `Pack`, transforms, and the loader state format."""
