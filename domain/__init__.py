"""Domain value types shared by actors/ and storage/: pure data and pure rules,
depending on neither (nor on server/ or protocol/)."""
