"""retrospec: datastore."""
