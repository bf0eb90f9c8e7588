package config

import (
	"os"
	"reflect"
	"strings"
	"testing"
)

// TestDocs: docs/config.md shows the examples as they are and mentions
// every field of the file format.
func TestDocs(t *testing.T) {
	doc, err := os.ReadFile("../../docs/config.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, ex := range []string{"../../deploy/examples/mesh.yaml", "../../deploy/examples/minimal.yaml"} {
		data, err := os.ReadFile(ex)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(doc), "```yaml\n"+string(data)+"```") {
			t.Errorf("docs/config.md does not show %s as it is", ex)
		}
	}
	seen := map[reflect.Type]bool{}
	var walk func(reflect.Type, string)
	walk = func(typ reflect.Type, path string) {
		for typ.Kind() == reflect.Pointer || typ.Kind() == reflect.Slice {
			typ = typ.Elem()
		}
		if typ.Kind() != reflect.Struct || seen[typ] {
			return
		}
		seen[typ] = true
		for i := range typ.NumField() {
			f := typ.Field(i)
			name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
			if name == "" || name == "-" {
				walk(f.Type, path) // From, To: their fields are documented
				continue
			}
			if !strings.Contains(string(doc), "`"+name+"`") && !strings.Contains(string(doc), "."+name+"`") {
				t.Errorf("docs/config.md does not document field %s%s", path, name)
			}
			walk(f.Type, path+name+".")
		}
	}
	walk(reflect.TypeFor[Config](), "")
	for _, k := range []string{"source", "operation", "matchLabels", "cidr", "except"} {
		if !strings.Contains(string(doc), k) {
			t.Errorf("docs/config.md does not mention %s", k)
		}
	}
}
