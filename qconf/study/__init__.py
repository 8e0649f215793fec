"""Config comparison studies (qconf compare) and their built-in tasks."""
