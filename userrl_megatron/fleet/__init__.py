"""The engine fleet: the engines' HTTP client, their launch (SGLang, the embedded server, the router), the Ray
pool that starts, watches and restarts them, their placement on the cluster, and the API key they require."""
