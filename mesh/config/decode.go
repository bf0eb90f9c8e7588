package config

import (
	"fmt"
	"net/netip"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/meshtun/meshtun/mesh/policy"
)

// decoder turns a yaml.Node tree into the Config structs strictly: every
// key must be a known field, every value of the right kind. It records the
// position of every value by its field path, so that errors found later
// (duplicates, unknown references) can name the line too.
type decoder struct {
	file  string
	pos   map[string]pos
	errs  []*Error
	warns []*Error
	// budget is how many more values decode may visit: aliases are
	// expanded, and a few nested aliases ("billion laughs") would
	// otherwise make a small file expand without end.
	budget int
}

// countNodes counts the nodes of a tree without following aliases.
func countNodes(n *yaml.Node) int {
	c := 1
	for _, k := range n.Content {
		c += countNodes(k)
	}
	return c
}

type pos struct{ line, col int }

func newDecoder(file string) *decoder {
	return &decoder{file: file, pos: make(map[string]pos)}
}

// at returns the position of path, or of its nearest ancestor that has one.
func (d *decoder) at(path string) pos {
	for {
		if p, ok := d.pos[path]; ok {
			return p
		}
		if path == "" {
			return pos{}
		}
		i := strings.LastIndexAny(path, ".[")
		if i < 0 {
			path = ""
		} else {
			path = path[:i]
		}
	}
}

// has reports whether the file set path (to anything, null included).
func (d *decoder) has(path string) bool {
	_, ok := d.pos[path]
	return ok
}

func (d *decoder) problem(path, format string, args []any) *Error {
	p := d.at(path)
	return &Error{File: d.file, Line: p.line, Column: p.col, Path: path, Reason: fmt.Sprintf(format, args...)}
}

// errorf records an error at path.
func (d *decoder) errorf(path, format string, args ...any) {
	d.errs = append(d.errs, d.problem(path, format, args))
}

// warnf records a warning at path.
func (d *decoder) warnf(path, format string, args ...any) {
	d.warns = append(d.warns, d.problem(path, format, args))
}

// errorAt records an error at node n, which is at path.
func (d *decoder) errorAt(n *yaml.Node, path, format string, args ...any) {
	d.errs = append(d.errs, &Error{File: d.file, Line: n.Line, Column: n.Column, Path: path, Reason: fmt.Sprintf(format, args...)})
}

func kindName(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.ScalarNode:
		if n.Tag == "!!null" {
			return "nothing"
		}
		return strconv.Quote(n.Value)
	}
	return "something else"
}

func join(p, field string) string {
	if p == "" {
		return field
	}
	return p + "." + field
}

var (
	addrType     = reflect.TypeFor[netip.Addr]()
	prefixType   = reflect.TypeFor[netip.Prefix]()
	ipBlockType  = reflect.TypeFor[policy.IPBlock]()
	durationType = reflect.TypeFor[time.Duration]()
	selectorType = reflect.TypeFor[Selector]()
	fromType     = reflect.TypeFor[From]()
	toType       = reflect.TypeFor[To]()
)

// l7Fields are Istio's source and operation fields that need HTTP: they
// are decoded (a list of strings) and kept by name, for validatePolicies
// to treat as Istio's ztunnel does.
var l7Fields = map[reflect.Type]map[string]bool{
	reflect.TypeFor[Source](): {
		"requestPrincipals": true, "notRequestPrincipals": true, "remoteIpBlocks": true, "notRemoteIpBlocks": true,
	},
	reflect.TypeFor[Operation](): {
		"hosts": true, "notHosts": true, "methods": true, "notMethods": true, "paths": true, "notPaths": true,
	},
}

// decode decodes n into v. opt is the ",option" of the field's yaml tag
// ("port": an integer 1-65535).
func (d *decoder) decode(n *yaml.Node, v reflect.Value, path, opt string) {
	if n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	if d.budget--; d.budget < 0 {
		if d.budget == -1 {
			d.errorAt(n, path, "aliases expand the file too much")
		}
		return
	}
	d.pos[path] = pos{n.Line, n.Column}
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		return // absent: keep the zero value (defaults come later)
	}
	switch v.Type() {
	case addrType:
		s, ok := d.scalar(n, path, "an IP address")
		if !ok {
			return
		}
		a, err := netip.ParseAddr(s)
		if err != nil || a.Zone() != "" {
			d.errorAt(n, path, "%q is not an IP address", s)
			return
		}
		v.Set(reflect.ValueOf(a.Unmap()))
		return
	case prefixType:
		s, ok := d.scalar(n, path, "a CIDR")
		if !ok {
			return
		}
		p, err := policy.ParsePrefix(s)
		if err != nil {
			d.errorAt(n, path, "%v", err)
			return
		}
		v.Set(reflect.ValueOf(p))
		return
	case ipBlockType:
		d.ipBlock(n, v, path)
		return
	case durationType:
		s, ok := d.scalar(n, path, "a duration")
		if !ok {
			return
		}
		dur, err := time.ParseDuration(s)
		if err != nil || dur <= 0 {
			d.errorAt(n, path, "%q is not a positive duration (like 1h or 30m)", s)
			return
		}
		v.SetInt(int64(dur))
		return
	case selectorType:
		if n.Kind == yaml.MappingNode && len(n.Content) == 2 && n.Content[0].Value == "matchLabels" {
			// Istio's form: selector: {matchLabels: {…}}.
			d.pos[path+".matchLabels"] = pos{n.Content[1].Line, n.Content[1].Column}
			d.decode(n.Content[1], v, path+".matchLabels", "")
			return
		}
	case fromType:
		d.wrapped(n, v, path, "source")
		return
	case toType:
		d.wrapped(n, v, path, "operation")
		return
	}
	switch v.Kind() {
	case reflect.Pointer:
		nv := reflect.New(v.Type().Elem())
		d.decode(n, nv.Elem(), path, opt)
		v.Set(nv)
	case reflect.Struct:
		d.decodeStruct(n, v, path)
	case reflect.Slice:
		if n.Kind != yaml.SequenceNode {
			d.errorAt(n, path, "expected a list, found %s", kindName(n))
			return
		}
		s := reflect.MakeSlice(v.Type(), len(n.Content), len(n.Content))
		for i, c := range n.Content {
			d.decode(c, s.Index(i), fmt.Sprintf("%s[%d]", path, i), opt)
		}
		v.Set(s)
	case reflect.Map:
		if n.Kind != yaml.MappingNode {
			d.errorAt(n, path, "expected a mapping, found %s", kindName(n))
			return
		}
		m := reflect.MakeMapWithSize(v.Type(), len(n.Content)/2)
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, val := n.Content[i], n.Content[i+1]
			kp := join(path, k.Value)
			if k.Kind != yaml.ScalarNode || k.Value == "" {
				d.errorAt(k, path, "keys must be non-empty strings")
				continue
			}
			if m.MapIndex(reflect.ValueOf(k.Value)).IsValid() {
				d.errorAt(k, kp, "key %q appears twice", k.Value)
				continue
			}
			ev := reflect.New(v.Type().Elem()).Elem()
			d.decode(val, ev, kp, "")
			m.SetMapIndex(reflect.ValueOf(k.Value), ev)
		}
		v.Set(m)
	case reflect.String:
		if s, ok := d.scalar(n, path, "a string"); ok {
			v.SetString(s)
		}
	case reflect.Bool:
		if n.Kind != yaml.ScalarNode || n.Tag != "!!bool" {
			d.errorAt(n, path, "expected true or false, found %s", kindName(n))
			return
		}
		b, _ := strconv.ParseBool(strings.ToLower(n.Value))
		v.SetBool(b)
	case reflect.Int, reflect.Int32, reflect.Int64, reflect.Uint16, reflect.Uint32:
		d.integer(n, v, path, opt)
	default:
		panic(fmt.Sprintf("config: cannot decode into %s", v.Type()))
	}
}

func (d *decoder) scalar(n *yaml.Node, path, want string) (string, bool) {
	if n.Kind != yaml.ScalarNode {
		d.errorAt(n, path, "expected %s, found %s", want, kindName(n))
		return "", false
	}
	return n.Value, true
}

func (d *decoder) integer(n *yaml.Node, v reflect.Value, path, opt string) {
	port := opt == "port"
	ok := n.Kind == yaml.ScalarNode && (n.Tag == "!!int" || (port && n.Tag == "!!str"))
	var i int64
	if ok {
		var err error
		i, err = strconv.ParseInt(n.Value, 0, 64)
		ok = err == nil
	}
	if !ok {
		if port {
			d.errorAt(n, path, "%s is not a port number (1-65535)", kindName(n))
		} else {
			d.errorAt(n, path, "expected an integer, found %s", kindName(n))
		}
		return
	}
	if port {
		if i < 1 || i > 65535 {
			d.errorAt(n, path, "%d is not a port number (1-65535)", i)
			return
		}
	} else if (v.CanInt() && v.OverflowInt(i)) || (v.CanUint() && (i < 0 || v.OverflowUint(uint64(i)))) {
		d.errorAt(n, path, "%d is out of range", i)
		return
	}
	if v.CanUint() {
		v.SetUint(uint64(i))
	} else {
		v.SetInt(i)
	}
}

// decodeStruct decodes a mapping into a struct by the fields' yaml tags;
// unknown and repeated keys are errors.
func (d *decoder) decodeStruct(n *yaml.Node, v reflect.Value, path string) {
	if n.Kind != yaml.MappingNode {
		d.errorAt(n, path, "expected a mapping, found %s", kindName(n))
		return
	}
	t := v.Type()
	type field struct {
		index int
		opt   string
	}
	fields := map[string]field{}
	var names []string
	for i := range t.NumField() {
		f := t.Field(i)
		tag := f.Tag.Get("yaml")
		if !f.IsExported() || tag == "-" || tag == "" {
			continue
		}
		name, opt, _ := strings.Cut(tag, ",")
		fields[name] = field{i, opt}
		names = append(names, name)
	}
	seen := map[string]bool{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, val := n.Content[i], n.Content[i+1]
		kp := join(path, k.Value)
		f, ok := fields[k.Value]
		switch {
		case !ok && l7Fields[t][k.Value]:
			if seen[k.Value] {
				d.errorAt(k, kp, "field %q appears twice", k.Value)
				continue
			}
			seen[k.Value] = true
			var vals []string
			d.decode(val, reflect.ValueOf(&vals).Elem(), kp, "")
			f := l7Field{name: k.Value}
			switch x := v.Addr().Interface().(type) {
			case *Source:
				x.l7 = append(x.l7, f)
			case *Operation:
				x.l7 = append(x.l7, f)
			}
			continue
		case !ok:
			sort.Strings(names)
			d.errorAt(k, kp, "unknown field %q (known fields: %s)", k.Value, strings.Join(names, ", "))
			continue
		case seen[k.Value]:
			d.errorAt(k, kp, "field %q appears twice", k.Value)
			continue
		}
		seen[k.Value] = true
		d.decode(val, v.Field(f.index), kp, f.opt)
	}
}

// wrapped decodes From or To: Istio's {source: {…}} (or {operation: {…}})
// or the inner mapping directly.
func (d *decoder) wrapped(n *yaml.Node, v reflect.Value, path, key string) {
	if n.Kind != yaml.MappingNode {
		d.errorAt(n, path, "expected a mapping, found %s", kindName(n))
		return
	}
	inner := v.Field(0) // Source or Operation
	for i := 0; i < len(n.Content); i += 2 {
		if n.Content[i].Value != key {
			continue
		}
		if len(n.Content) != 2 {
			d.errorAt(n, path, "write either %s: {…} or its fields directly, not both", key)
			return
		}
		switch w := v.Addr().Interface().(type) {
		case *From:
			w.wrapped = true
		case *To:
			w.wrapped = true
		}
		val := n.Content[1]
		d.pos[path+"."+key] = pos{val.Line, val.Column}
		if val.Kind == yaml.ScalarNode && val.Tag == "!!null" {
			return
		}
		d.decodeStruct(val, inner, path+"."+key)
		return
	}
	d.decodeStruct(n, inner, path)
}

// ipBlock decodes "10.0.0.0/8", "10.1.2.3" or {cidr: 10.0.0.0/8, except: [10.1.0.0/16]}.
func (d *decoder) ipBlock(n *yaml.Node, v reflect.Value, path string) {
	switch n.Kind {
	case yaml.ScalarNode:
		b, err := policy.ParseIPBlock(n.Value)
		if err != nil {
			d.errorAt(n, path, "%v", err)
			return
		}
		v.Set(reflect.ValueOf(b))
	case yaml.MappingNode:
		var raw struct {
			CIDR   netip.Prefix   `yaml:"cidr"`
			Except []netip.Prefix `yaml:"except"`
		}
		before := len(d.errs)
		d.decodeStruct(n, reflect.ValueOf(&raw).Elem(), path)
		if len(d.errs) > before {
			return
		}
		if !raw.CIDR.IsValid() {
			d.errorAt(n, path+".cidr", "is required")
			return
		}
		v.Set(reflect.ValueOf(policy.IPBlock{CIDR: raw.CIDR, Except: raw.Except}))
	default:
		d.errorAt(n, path, "expected a CIDR or {cidr: …, except: […]}, found %s", kindName(n))
	}
}
