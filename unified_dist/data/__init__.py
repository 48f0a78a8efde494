"""Loading data so that the order does not depend on the world size: map-style loaders
(:mod:`.loaders`) and streams (:mod:`.streams`). Below the session."""
